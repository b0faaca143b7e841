"""sandman: stateful Kubernetes sandboxes for agentic RL. The shared contract lives in
`sandman.contract`; the trainers' client SDK in `sandman.client`."""

__version__ = "0.1.0"
