"""What runs inside a rank: the worker entry, the bootstrap, the backend check, the SageMaker entry. Never imports kernel code."""
