"""Experiment configs (`get_config(arg)` per file) and the blocks they share (`experiments.common`)."""
