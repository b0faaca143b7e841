"""netguard: the in-pod network guard, run as the first init container of a sandbox pod.

See docs/netguard.md for what it guarantees, and netguard/README.md for the invariants.
"""
