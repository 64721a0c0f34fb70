"""Harnesses: what labs, tests and benchmarks use to start and drive fleets of real
processes (chapters 2, 3, 5 and 8).

Nothing in labkit's chapters imports from here: the gateway, the autoscaler and the monitor
work on URLs they are given; a harness starts the servers behind those URLs, sends load, and
kills or holds backends for the fault experiments.
"""
