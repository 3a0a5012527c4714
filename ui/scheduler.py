import streamlit as st

st.title("scheduler")
st.info("This page is being built.")
