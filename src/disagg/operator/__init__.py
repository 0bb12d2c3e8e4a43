"""disagg.operator: the InferenceDeployment CRD's operator (kopf handlers over pure builders)."""
