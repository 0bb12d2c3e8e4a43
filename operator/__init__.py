"""disagg.operator."""
