"""Worker groups: `inline` (in the driver process) and `ray` (one actor per GPU or CPU slot)."""
