"""smdistributed.dataparallel.torch.parallel served by sdp_jupyter."""
