"""Framework adapters: each module imports its framework (an optional extra)."""
