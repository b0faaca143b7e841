"""sandman's cluster-level controller: paced creates that own every pod, a warm pool, and the
acquire/release API. Run as `python3 -m controller serve`; see docs/controller.md."""
