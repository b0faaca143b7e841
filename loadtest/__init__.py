"""Load tests for sandman (locust, one locustfile per pattern) and `make demo`; see
docs/loadtest.md."""
