"""Cluster mode: stateless front ends routing to one sandbox host per Ray node.

``shoal serve --cluster ADDRESS`` runs a front end: it runs no sandbox, holds no
session, and any number of them serve the same cluster. The nodes of the Ray
cluster that offer the ``shoal_host`` resource each get a sandbox host
(:mod:`.host`), a Shoal server of their own; Ray says which nodes are alive
(:mod:`.membership`), and the front end (:mod:`.frontend`) sends each request
where its state is: a session's or a run's calls to the host whose key its id
carries, a container's to the host it is placed on (a row in the cluster's
database), anything new to the host with the most room.
"""

from .host import HOST_RESOURCE, NAMESPACE, node_key

__all__ = ["HOST_RESOURCE", "NAMESPACE", "node_key"]
