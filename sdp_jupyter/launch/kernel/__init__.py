"""The notebook's side of a job: launchers, the Job handle, the warm-pool policy. Never imports torch."""
