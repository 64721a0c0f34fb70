"""Checks for the labs' exercises, one module per chapter (``ch01``, ``ch03``, ...).

Each check takes the student's answer and the exercise's parameters, computes the expected
value with labkit, and names the usual mistakes (see :mod:`labkit.grading`).
"""
