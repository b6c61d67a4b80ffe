"""What each CLI command does: index, answer, stats."""
