"""Lion Cub's benchmarks and studies (bench/README.md): scripts run from the repository root as
modules, ``PYTHONPATH=src python3 -m bench.<script>``; shared pieces in :mod:`bench._runner`.
Not part of the installed package."""
