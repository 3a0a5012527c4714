import streamlit as st

st.title("launch")
st.info("This page is being built.")
