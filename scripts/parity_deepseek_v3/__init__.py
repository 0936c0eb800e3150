"""The pieces of scripts/make_parity_fixtures.py (DeepSeek-V3 parity fixtures against transformers):
the fixture specs, the weights and their storage, the float64 numpy reference and the transformers
side. Needs torch and transformers>=5 (``pip install -e .[parity]``)."""
