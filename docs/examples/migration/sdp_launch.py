"""After: the same smddp_train.py through sdp_jupyter (docs/migration.md, path B).

    python sdp_launch.py              # 2 local nodes on this machine, smddp on sdp_jupyter's engine
    python sdp_launch.py sagemaker    # the same job as a SageMaker training job (AWS credentials needed)
"""
import sys
from pathlib import Path

import sdp_jupyter

script = Path(__file__).with_name("smddp_train.py")
hyperparameters = {"epochs": 5, "lr": 0.05}

if sys.argv[1:] == ["sagemaker"]:
    job = sdp_jupyter.launch(script, target="sagemaker", nodes=2, backend="smddp",
                             instance_type="ml.p4d.24xlarge", hyperparameters=hyperparameters,
                             role="arn:aws:iam::111122223333:role/SageMakerRole")
else:
    job = sdp_jupyter.launch(script, nodes=2, backend="smddp", hyperparameters=hyperparameters)
state = job.wait()
print(job.logs(0), end="")
print(f"{job.name}: {state}")  # locally, rank 0 saved model.pt in the job directory's model/ (SM_MODEL_DIR)
sys.exit(0 if state == "succeeded" else 1)
