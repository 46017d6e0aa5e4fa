"""Test infrastructure that ships with the package: hosts in network namespaces (cluster.py) and an
sshd on them (sshd.py)."""
