"""What runs once per host: spawning the host's ranks, the per-host agent, the warm-pool server."""
