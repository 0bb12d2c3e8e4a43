"""disagg.worker."""
