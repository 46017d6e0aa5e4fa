"""smdistributed.dataparallel.torch served by sdp_jupyter."""
