# Kept for editable installs with older pip; all metadata lives in setup.cfg.
from setuptools import setup

setup()
