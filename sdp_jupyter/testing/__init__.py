"""Test infrastructure that ships with the package: hosts in network namespaces (cluster.py)."""
