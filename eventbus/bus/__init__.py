"""The wire and both of its ends: codec, journal, publisher thread, request service, subscriber.

Importable and usable without torch.
"""
