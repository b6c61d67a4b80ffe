"""Scoring answers against gold, and fidelity to full attention."""
