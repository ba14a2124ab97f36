"""The rbd target, against a throwaway Ceph cluster."""
