"""MetaSchedule search: design spaces, the tune driver, and the tuning-log (database) helpers."""
