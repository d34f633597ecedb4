"""A run's life around the loop: its directory (`run_dir`) and the lock that keeps it to one run (`run_lock`),
where it starts (`run_start`) and resumes from (`resume`), the summary it prints first (`summary`), and the
signals that stop it cleanly (`stop_signals`)."""
