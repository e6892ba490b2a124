"""Draft models and checkpoint handling."""
