"""Federated training on Flower's own server and client processes (``pip install edgetrain[fleet]``); see ``app.py``."""
from edgetrain.fleet.app import EdgetrainStrategy, FleetSpec, client_app, fleet_spec, run_server, server_app

__all__ = ["EdgetrainStrategy", "FleetSpec", "client_app", "fleet_spec", "run_server", "server_app"]
