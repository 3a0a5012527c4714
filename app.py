"""GPUMix dashboard: a router over thin pages (widgets -> one library call -> render)."""
import streamlit as st

st.set_page_config(page_title="GPUMix", page_icon=":material/memory:", layout="wide")

PAGES = {
    "Cluster": [
        st.Page("ui/inventory.py", title="Inventory", icon=":material/dns:", url_path="inventory", default=True),
        st.Page("ui/memory.py", title="Model & memory", icon=":material/memory:", url_path="memory"),
    ],
    "Train": [
        st.Page("ui/plan.py", title="Plan", icon=":material/account_tree:", url_path="plan"),
        st.Page("ui/launch.py", title="Launch & monitor", icon=":material/rocket_launch:", url_path="launch"),
        st.Page("ui/runs.py", title="Runs", icon=":material/history:", url_path="runs"),
    ],
    "Fleet": [
        st.Page("ui/scheduler.py", title="Scheduler", icon=":material/view_timeline:", url_path="scheduler"),
        st.Page("ui/geo.py", title="Geo", icon=":material/public:", url_path="geo"),
    ],
}

st.navigation(PAGES).run()
