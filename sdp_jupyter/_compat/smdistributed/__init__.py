"""sdp_jupyter's stand-in for SageMaker's smdistributed (data parallel only). See ../README.md."""
