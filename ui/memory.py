import streamlit as st

st.title("memory")
st.info("This page is being built.")
