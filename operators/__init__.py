"""kopf operator: pure manifest builders (RLJob -> KubeRay RayJob) and thin handlers."""
