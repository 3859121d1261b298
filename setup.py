"""mmpar: pick how a PyTorch model is trained in parallel from a config file."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r"__version__ = '([^']+)'",
                    (HERE / 'mmpar' / 'version.py').read_text()).group(1)

setup(
    name='mmpar',
    version=VERSION,
    description='Config-driven parallel training (DDP, FSDP, custom data '
    'parallel) on MMEngine',
    long_description=(HERE / 'README.md').read_text(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mmpar', 'mmpar.*']),
    package_data={'mmpar.datasets': ['data/*.npz', 'data/*.md', 'data/*.xz',
                                    'data/*.jsonl',
                                    'data/shakespeare_bpe/*.json']},
    python_requires='>=3.9',
    # Ranges a user on a GPU machine can meet with the torch build they already
    # have; requirements.txt holds the exact set CI tests.
    install_requires=['torch>=2.4', 'mmengine>=0.10.5,<0.11', 'numpy>=1.24'],
    # pip install -e '.[hf]': Hugging Face models from config (HFCausalLM).
    extras_require={
        'tests': ['pytest>=7.4'],
        'hf': ['transformers>=5.0', 'safetensors>=0.4', 'tokenizers>=0.21']
    },
    license='Apache-2.0',
)
