"""Names the operator, its children and the CRD agree on."""

GROUP = "disagg.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

FIELD_MANAGER = "disagg-operator"
FINALIZER = "disagg.dev/finalizer"

ROLES = ("prefill", "decode")

# Label keys: the app.kubernetes.io set for tooling, the disagg.dev set for our own selectors.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_VERSION = "app.kubernetes.io/version"
LABEL_ROLE = "disagg.dev/role"
LABEL_DEPLOYMENT = "disagg.dev/deployment"

WORKER_GRPC_PORT = 50051
WORKER_METRICS_PORT = 9100
REDIS_PORT = 6379
MODEL_MOUNT = "/models"
