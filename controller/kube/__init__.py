"""The Kubernetes floor: the API client, the master ConfigMap, the CRDs and an API emulator."""
