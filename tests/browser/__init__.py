"""Browser tests (JupyterLab in Debian chromium). A package so its conftest does not shadow tests/conftest.py."""
