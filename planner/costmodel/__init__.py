"""The one cost model: time of any configuration the runtime can execute, collectives priced
as the runtime issues them. Imports only `planner.core`.
"""
