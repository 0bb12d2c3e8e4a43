"""A real Kubernetes node for the end-to-end tests (`make node-up`, `make node-down`): see rig.py."""
