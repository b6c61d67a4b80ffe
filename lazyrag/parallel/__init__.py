"""Answering across GPUs and machines (`answer --data-parallel N`, `--ray-address ADDR`): engine
actors on Ray Core, one per GPU, fed by a router that keeps queries sharing chunks on the same
engine. router.py is pure (no Ray, no torch); cluster.py checks the options, starts or joins Ray
and places the engines; engines.py is the actor; driver.py feeds the engines and writes the answers;
stats.py each engine's share of the run record."""
