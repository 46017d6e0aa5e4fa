"""Worker-side reporter, per-node system sampler, and the kernel-side reader of job metrics."""
