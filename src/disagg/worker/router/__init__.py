"""The OpenAI-compatible router: HTTP front door, validation, routing policy, worker clients."""
