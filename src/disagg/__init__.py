"""disagg: disaggregated LLM serving on Kubernetes.

Packages by layer, lowest first: `proto` and `kernels`; `worker.model`, `worker.engine`, the KV
packages, `worker.serving`, `worker.router`, `worker.planner`, `worker.cli`; and `operator`, which
reconciles InferenceDeployments and uses only the worker's torch-free settings modules."""
