"""sandman's admission webhook: makes labelled pods correct sandboxes and refuses the rest.
Entry point: `python3 -m webhook serve|certs|manifests`. See docs/webhook.md."""
