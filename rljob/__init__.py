"""The RLJob API type shared by the service, the operator and the workers (job spec, status,
phases, and the CRD schema generated from them). Depends on pydantic only."""
