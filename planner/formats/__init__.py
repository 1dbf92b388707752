"""File contracts of docs/formats.md: profile, cluster and plan, validated once at the boundary."""

from planner.formats.cluster import Cluster, Device, Link, cluster_from_dict, load_cluster, save_cluster
from planner.formats.jsonio import check_writable, read_document, write_json_atomic
from planner.formats.plan import SCHEDULES, Plan, Stage, load_plan, plan_from_dict, save_plan
from planner.formats.profile import INPUT_OP, Node, OpTime, Profile, load_profile, profile_from_dict, save_profile

__all__ = [
    "Cluster", "Device", "Link", "cluster_from_dict", "load_cluster", "save_cluster",
    "check_writable", "read_document", "write_json_atomic",
    "SCHEDULES", "Plan", "Stage", "load_plan", "plan_from_dict", "save_plan",
    "INPUT_OP", "Node", "OpTime", "Profile", "load_profile", "profile_from_dict", "save_profile",
]
