"""disagg.proto."""
