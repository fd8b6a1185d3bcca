"""Parameter-server mode over MPI point-to-point messages.

Servers hold the parameters in blocks (``blocks``) and the rows of sparse embedding tables;
workers compute gradients on their data, push them and pull parameters back (``worker``), and
the servers apply them (``server``): synchronously, asynchronously, or GEO (``mode``). Every
message travels on a duplicate of ``MPI.COMM_WORLD`` (``wire``); no port is opened. ``runtime``
holds the ``fleet.init_server``/``run_server``/``init_worker``/``stop_worker`` calls and
``shards`` the servers' checkpoint files.
"""
