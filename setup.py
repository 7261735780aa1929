"""The one thing setup.cfg cannot say: the CUDA sources live in the top-level ``kernels/``
folder and ship in the wheel as ``ringcomm/kernels/cuda/`` (package data, no Python there).
An editable install or a checkout reads them from ``kernels/`` itself. The dispatcher finds
them by path (``ringcomm.kernels.KERNEL_DIR``), never by importing ``ringcomm.kernels.cuda``:
an editable install does not make that name importable."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["ringcomm", "ringcomm.*"]) + ["ringcomm.kernels.cuda"],
      package_dir={"ringcomm.kernels.cuda": "kernels"})
