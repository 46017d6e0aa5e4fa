"""Before: submitting smddp_train.py with the SageMaker Python SDK's PyTorch estimator (SDK v2).

This needs AWS credentials, a role and an S3 bucket; it is shown for the mapping to sdp_jupyter's
options (docs/migration.md, path B).
"""
from sagemaker.pytorch import PyTorch

estimator = PyTorch(
    entry_point="smddp_train.py",
    role="arn:aws:iam::111122223333:role/SageMakerRole",
    instance_count=2,
    instance_type="ml.p4d.24xlarge",
    framework_version="2.3.0",
    py_version="py311",
    distribution={"smdistributed": {"dataparallel": {"enabled": True}}},
    hyperparameters={"epochs": 5, "lr": 0.05},
)
estimator.fit()
