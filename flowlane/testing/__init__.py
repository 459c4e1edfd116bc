"""Tools for tests and benchmarks, not for training jobs: an emulated network of Linux network namespaces
(``netem``) and a synthetic PP x DP x EP iteration on the Hermod runtime (``workload``)."""
