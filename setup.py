"""The one thing setup.cfg cannot say: the CUDA sources live in the top-level ``kernels/``
folder and ship in the wheel as ``ringcomm/kernels/cuda/`` (package data, no Python there).
An editable install or a checkout reads them from ``kernels/`` itself."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["ringcomm", "ringcomm.*"]) + ["ringcomm.kernels.cuda"],
      package_dir={"ringcomm.kernels.cuda": "kernels"})
