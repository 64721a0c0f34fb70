"""The tutorial's original code, kept to be judged, one module per chapter (``ch05_autoscaling``,
``ch06_cost``, ...) as ``labkit.exercises`` has one per lab.

Each module holds the tutorial's code as the tutorial wrote it, bugs included, returning its
numbers instead of printing them; its docstrings say what each piece gets wrong and where labkit
does it right. The chapters' "What the tutorial gets wrong" sections, the labs and the tests call
them to show each error as a number, never to compute anything else:

- :mod:`~labkit.tutorial.ch05_gateway`: its gateway's round robin
  (:ref:`ch05-choosing-backend`);
- :mod:`~labkit.tutorial.ch05_autoscaling`: its ``AutoScaler`` and its demo
  (:ref:`ch05-tutorial-wrong`);
- :mod:`~labkit.tutorial.ch06_cost`: its cost calculator (:ref:`ch06-tutorial-wrong`);
- :mod:`~labkit.tutorial.ch06_sharing`: its two models on one GPU
  (:ref:`ch06-sharing-tutorial-wrong`);
- :mod:`~labkit.tutorial.ch07_tco`: its cloud-versus-self-hosted comparison
  (:ref:`ch07-tutorial-wrong`);
- :mod:`~labkit.tutorial.ch08_deploy`: its deploy script's server command
  (:ref:`ch08-tutorial-wrong`);
- :mod:`~labkit.tutorial.ch08_monitoring`: its monitor's metric lookups
  (:ref:`ch08-tutorial-wrong`).
"""
